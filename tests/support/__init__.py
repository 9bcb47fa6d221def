"""Test support: real servers on ephemeral loopback ports, a private Redis."""
