"""The torch binding's registrations, read from csrc/pkv_ops.cpp without building it: an op
schema that does not parse, or a C++ function whose parameters do not match its schema, stops the
whole extension from loading, and only the GPU machine loads it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

SOURCE = (Path(__file__).resolve().parent.parent / "csrc" / "pkv_ops.cpp").read_text()


def _schemas() -> dict[str, str]:
    block = SOURCE[SOURCE.index("TORCH_LIBRARY(pkv, m)"):SOURCE.index("TORCH_LIBRARY_IMPL(pkv")]
    schemas = {}
    for pieces in re.findall(r'm\.def\(\s*((?:"[^"]*"\s*)+)\)', block):
        schema = "".join(re.findall(r'"([^"]*)"', pieces))
        schemas[schema.split("(", 1)[0]] = schema
    return schemas


def _cpp_parameters(name: str) -> list[str]:
    """The parameters of the C++ function `name` registered by m.impl, split at top-level commas."""
    start = re.search(rf"\n\w[\w:<>]* {name}\(", SOURCE).end()
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(SOURCE[end], 0)
        end += 1
    parameters, depth, current = [], 0, ""
    for char in SOURCE[start:end - 1]:
        depth += {"<": 1, ">": -1}.get(char, 0)
        if char == "," and depth == 0:
            parameters.append(current.strip())
            current = ""
        else:
            current += char
    return parameters + [current.strip()]


def test_every_op_is_defined_and_implemented():
    impls = set(re.findall(r'm\.impl\("(\w+)"', SOURCE))
    assert impls == set(_schemas()) and len(impls) == 7


@pytest.mark.parametrize("name", sorted(_schemas()))
def test_each_schema_parses_and_matches_its_cpp_function(name):
    schema = torch._C.parse_schema("pkv::" + _schemas()[name])
    parameters = _cpp_parameters(name)
    assert len(parameters) == len(schema.arguments), (name, parameters)
    for parameter, argument in zip(parameters, schema.arguments):
        optional = argument.type.kind() == "OptionalType"
        # Tensor? is std::optional<Tensor>, Tensor is Tensor, int is int64_t, float is double.
        assert ("std::optional" in parameter) == optional, (name, parameter, str(argument.type))
        assert parameter.split()[-1] == argument.name, (name, parameter, argument.name)
