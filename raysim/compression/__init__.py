"""Compression of what clients send (issue 57): codecs.py (encode / decode, bit-packed
messages whose length is the bytes that travel) and error_feedback.py (the residual a client
keeps of what its messages dropped)."""
