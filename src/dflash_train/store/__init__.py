"""The offline feature store: the target's selected-layer features of every row, on disk.

`dflash-train capture` writes one through the pipeline's own stages (prefetchers, target
workers, then a store writer in the drafters' place); `train --features` reads it with
`StoreReader`s in the target workers' place; `train --cache-features` (the hybrid) fills one
during the first epoch with `CachingReader`s. Modules: `codec` (a row's bytes per dtype: fp32,
bf16, fp8 e4m3 with a scale per token and layer), `manifest` (what a store is bound to),
`shards` (append-only value and index files), `lock` (one writer per store directory),
`store` (`FeatureStore`: open, read, append, commit, the parts several nodes write, size
estimate), `reader`, `cache` (the hybrid's source rule).
"""
