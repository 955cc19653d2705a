"""Test helpers that ship with kvtier: tiny checkpoints written by code."""
