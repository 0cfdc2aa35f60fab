"""The cluster simulator: the product's HistoPipe scheduler driven by an event loop over
simulated engines, on synthetic or recorded workloads."""
