"""The Chameleon family: Anole and Lumina-mGPT, read from their Hugging Face folders, prompted by
token rows in the model's own vocabulary."""
