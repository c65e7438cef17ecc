"""Building blocks of the model: tensor-parallel linears, attention, MLP, MoE."""
