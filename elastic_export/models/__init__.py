"""Models in: loading (local folders, hub ids, timm names), the encoder wrapper, family adapters, the
unit inventory, preprocessing, text in.
"""
