"""gemjax: training and serving for long-sequence recommendation models.

Data flows one way: `gemjax.data` (event logs -> jagged batches) ->
`gemjax.model` (Flax NNX modules calling `pallas_kernels` ops) ->
`gemjax.train` (step, optimizer, checkpoints, metrics), with `sharding`
deciding where every array lives.
"""
