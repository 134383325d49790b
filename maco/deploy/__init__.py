"""From a model to the model handed back: kernel choice, the pipeline both front doors call
(`maco optimize` and the torch.compile backend), the report, saved models, engines."""
