"""Ways to split a model beyond ZeRO. So far pipeline parallelism with DeepSpeed's API: named
process topologies with their groups (`partita.parallel.topology`), DeepSpeed's pipeline
instruction schedules (`partita.parallel.pipe_schedule`), the layer-list model cut into stages
(`partita.parallel.pipe_module`: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``) and the
engine that runs the 1F1B schedule (`partita.parallel.pipe_engine`: ``PipelineEngine``, what
``initialize`` returns for a ``PipelineModule``)."""
