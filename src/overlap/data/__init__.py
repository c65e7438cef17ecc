"""Real pretraining data: tokenizers, Megatron's indexed dataset files, GPT sample construction and
blending; and what the data decides at finalize (`resolution`: the tokenizer's vocabulary, the
blend's files, each a row of the decision table)."""
