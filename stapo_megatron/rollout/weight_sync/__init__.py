"""Weight sync from the trainer ranks to the rollout servers, one module per part.

* :mod:`.routes`: which rank's tensors reach which server, and how (pure: the layout check uses it);
* :mod:`.plan`: what every rank needs for an update (the engine makes it);
* :mod:`.session`: the update (one version everywhere, pause and continue, the tallies, refusals);
* :mod:`.transport`: the contract between the update and a transport;
* :mod:`.tensor` (CUDA IPC), :mod:`.distributed` (NCCL), :mod:`.disk` (safetensors files): the
  transports; :mod:`.in_process`: an engine in the controller's own process (the local engine).

Nothing is imported here, so that :mod:`.routes` stays free of torch.
"""
