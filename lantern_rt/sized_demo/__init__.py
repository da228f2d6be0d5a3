"""The demo at LlamaGen's GPT-B/L/XL shapes with its exact function (docs/method.md)."""
