"""The engine: model loading, the scheduler thread that owns the model, sampling."""
