"""Output parsers of chat responses: tool calls (hermes, qwen3_coder, forced), reasoning
(qwen3), and the pipeline that combines them with stop strings (output.py)."""
