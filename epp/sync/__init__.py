"""Active-active EPP replicas: each publishes the deltas of its own bookings, peers apply them.

``epp.sync.messages``  the wire schema (msgpack, versioned) and its codec
``epp.sync.deltas``    the messages' bodies typed: TOTALS, PREFIX, SNAPSHOT, HEARTBEAT
``epp.sync.state``     the pure apply layer (no I/O, injected clocks): :class:`ReplicaSyncState`,
                       which numbers and orders the messages of
``epp.sync.own_bookings``  this replica's bookings, their totals per endpoint, what is due out
``epp.sync.prefix_share``  the approximate prefix index's inserts, ours out and the peers' in
``epp.sync.peer_load``     the peers' published totals, where the local plugins read them
``epp.sync.membership``    the peers' incarnations, liveness, awaited snapshots, announcements
``epp.sync.hook``      the pipeline hook that feeds a request's lifecycle into the state
``epp.sync.nats_transport``  the NATS transport adapter the live EPP runs
``epp.sync.nats_auth``  its connection's auth and TLS options, from the EPP's settings
``epp.sync.metrics``   its Prometheus metrics
``epp.sync.scrape_owners``  which replica scrapes which endpoint (rendezvous hashing)
``epp.sync.scrape_share``   scrape sharing: publish the owned endpoints' scrapes, apply the peers'
"""
