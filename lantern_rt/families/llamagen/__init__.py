"""The LlamaGen family: class-conditional (c2i) and text-to-image (t2i, FLAN-T5 captions) models
in LlamaGen's own checkpoint layout or the LANTERN authors' Hugging Face conversion."""
