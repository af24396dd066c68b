"""kiln's "compute" box: models, paged attention, the model runner (torch.compile) and the sampler."""
