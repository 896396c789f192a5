"""The HTML report of a directory's measurements."""
