"""The ranking: methods, scoring, the elastic optimiser, unit masks, distributed ranking, the ranking
file, budget plans, the torch reference.
"""
