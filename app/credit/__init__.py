"""Credit: what each volunteer contributed, settled from signed claims and receipts, reviewed, ranked and exported."""
