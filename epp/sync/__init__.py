"""Active-active EPP replicas: each publishes the deltas of its own bookings, peers apply them.

``epp.sync.messages``  the wire schema (msgpack, versioned) and its codec
``epp.sync.state``     the pure apply layer (no I/O, injected clocks): :class:`ReplicaSyncState`
``epp.sync.hook``      the pipeline hook that feeds a request's lifecycle into the state
``epp.sync.nats_transport``  the NATS transport adapter the live EPP runs
``epp.sync.nats_auth``  its connection's auth and TLS options, from the EPP's settings
``epp.sync.metrics``   its Prometheus metrics
``epp.sync.scrape_owners``  which replica scrapes which endpoint (rendezvous hashing)
``epp.sync.scrape_share``   scrape sharing: publish the owned endpoints' scrapes, apply the peers'
"""
