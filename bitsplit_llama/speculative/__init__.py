"""Speculative decoding: draft trees and acceptance (tree), logit processing and draws (sampling),
the drafters and the draft/verify loop (engine), the tree shape chosen for this machine (autotree),
and the Generator, text in and text out, that every public entry point goes through."""
