"""Peer engines' worker processes for bench/peers.py, one module each (bench/common.py has
the ready/go/stop protocol they speak)."""
