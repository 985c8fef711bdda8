"""The one switch the FP8 modules read to report their casts: ``observer`` is None unless
transformer_fp8.debug is collecting statistics (then it dispatches to the enabled collectors).
A module of its own so that reading it imports nothing."""
observer = None
