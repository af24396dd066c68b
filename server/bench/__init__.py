"""kiln's benchmarks, behind `kiln bench`: they may import any box; no box imports them."""
