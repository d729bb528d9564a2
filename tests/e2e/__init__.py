"""End-to-end tests with a real vLLM engine (`make e2e`)."""
