"""The lowest room: what every config section's parser shares, in values.py
(reading a DeepSpeed JSON config, resolving "auto", checking integers, numbers
and booleans with a ValueError naming the key, and the one warning for a key
zero does not know). Standard library only; each room parses its own section with it."""
