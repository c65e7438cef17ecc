"""Which kernel runs, decided from what the machine and the tensors are: the capability probes
(device 0's compute capability, what torch.compile needs here) and the choice rules for the
attention product (`attention`), the MoE token permutation (`moe_permute`), the experts' GEMMs
(`grouped_gemm`) and the elementwise fusions (`fusion`). The kernels themselves are in `layers/`,
which applies these rules at call time; the rules sit below `config/`, whose resolution records
each choice for the run's device (`overlap.config.kernel_choices`) and checks the flex
dispatcher's GPU backends against `device`."""
