"""Long Range Arena: data generators, loaders, models, training and evaluation."""
