"""The Flower side of protofl: the wire format (:mod:`.wire`), the server template
(:mod:`.server`, a ``Strategy``) and the client template (:mod:`.client`, a ``NumPyClient``) that
every method in :mod:`protofl.strategies` fills in with hooks."""
