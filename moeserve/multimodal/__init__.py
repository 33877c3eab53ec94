"""Images for vision models: decoding (`images.py`), Kimi-K2.5's preprocessing and prompt
placeholders (`kimi.py`), what a request carries to the engine (`inputs.py`) and the
encoder-output cache (`cache.py`)."""
