"""A user reward (``reward.function``) for the DAPO end-to-end test. Prompts whose answer is a
multiple of 4 always score 0 (a group dynamic sampling must drop); the others score the parity of
the response's length in characters, which varies within a group of an untrained model's responses
(its length in words did not reliably: at one seed every group of a step, refills included, was
constant and the step trained nothing)."""


def length_parity(item) -> float:
    if int(item.answer) % 4 == 0:
        return 0.0
    return float(len(item.response_text) % 2)
