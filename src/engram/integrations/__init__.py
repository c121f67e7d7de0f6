"""Integrations with released models whose architectures carry hashed n-gram tables (`qwen4_exp`)."""
