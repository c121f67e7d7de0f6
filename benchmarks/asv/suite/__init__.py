"""engram's asv suite (benchmarks/asv/asv.conf.json): the core costs, written against the API that every tracked
commit since 089080e has, so `asv continuous BASE HEAD` can run them on both."""
