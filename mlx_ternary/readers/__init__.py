"""Readers translate foreign checkpoint layouts into the native format's terms."""
