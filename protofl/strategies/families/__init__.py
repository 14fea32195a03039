"""What several methods share, each family in its own module; a method file imports families and
:mod:`protofl.task`, never another method file (tests/test_structure.py).

- :mod:`~protofl.strategies.families.averaging`: a server that averages the clients' shared model
  entries, as FedAvg's (FedProx, MOON, FedNTD, FedRCL, Ditto, ...);
- :mod:`~protofl.strategies.families.model_parts`: a model split into a body and a head, one of them
  shared and the other kept on the node (FedPer, FedRep, FedBABU, LG-FedAvg, FedGen, FedGH, ...);
- :mod:`~protofl.strategies.families.second_model`: a second model trained beside the client's own,
  the second one shared (FML, FedKD);
- :mod:`~protofl.strategies.families.class_vectors`: class vectors averaged on the server and pulled
  toward on the client, FedProto's rule (FedDistill's server, FedTGP's client).
"""
