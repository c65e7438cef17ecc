"""Real pretraining data: tokenizers, Megatron's indexed dataset files, GPT sample construction and
blending."""
