"""The Flower side of protofl: the wire format (:mod:`.wire`), the server template
(:mod:`.server`, a ``Strategy``) and the client template (:mod:`.client`, a plain class that
:mod:`.numpy_front`'s ``NumPyClient`` fronts) that every method in :mod:`protofl.strategies` fills
in with hooks."""
