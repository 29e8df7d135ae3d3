"""The model layer: bert_fast's drop-in BertModel and everything it needs beside the ops.

Kept light on purpose (nothing is imported here): ``import bert_fast`` reads compat's version
floor without importing torch or transformers.
"""
