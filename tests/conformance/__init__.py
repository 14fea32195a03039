"""Conformance fixtures: numbers computed by the authors' own code on small fixed inputs.

``make_fixtures.py`` (run by hand, with the authors' repositories checked out somewhere outside
this tree) calls their functions and saves inputs and outputs as ``fixtures/<method>-<piece>.npz``;
``tests/test_conformance_<method>.py`` feeds the same inputs to protofl and compares. Nothing here
imports the authors' code at test time, and none of it is copied: the fixtures are numbers.
"""
