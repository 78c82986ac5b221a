"""Decoder layers that live off the device: their packed layout, the host store that keeps
them in RAM or on disk, the streamer that runs a pass while copying the next layers in, and
the prepared-layer cache that lets a second start skip quantisation.

Contract: layout.LayerLayout packs any decoder layer of a model into one flat byte buffer
(dense or NF4); host_store.HostStore keeps packed layers in (pinned) RAM arenas and a
memory-mapped disk file; streamer.LayerStreamer runs all layers of a pass in order through a
ring of device slots (on CUDA: a side copy stream ordered by events; on CPU: the same schedule
with a worker thread); prepared.PreparedLayers reads and writes the on-disk NF4 cache.

What it does not do: read checkpoints or build models (engine.loading), decide how many layers
go where (engine.planning.placement), or know about tokens.
"""
