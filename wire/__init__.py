"""Contracts between the project's own processes: what the EPP, the training server and the
prediction servers send each other over HTTP, the HTTP plumbing the two servers share, and the
bearer token that guards their mutating routes (``auth``).
(Envoy's ext_proc types are not here: they come from the ``xds-protos`` package.)"""
