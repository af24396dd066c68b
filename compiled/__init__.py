"""kiln's "compute" box, the worker: models, paged attention, model runner, compile policy, sampler."""
