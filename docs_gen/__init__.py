"""Generates docs/reference/ from the code: the plugins, the request headers, the sidecars' HTTP
APIs and the chart's values. Development tooling, not packaged (like dashboards/): ``make docs``
writes the files, tests/test_reference_docs.py checks that the checked-in ones are current."""
