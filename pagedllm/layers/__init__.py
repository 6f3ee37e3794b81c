"""Model building blocks shared by every architecture (the sampler lives in `sampler.py`)."""
