"""The coordinator <-> worker contract, imported by both and importing neither: the
messages (orders and reports, ``messages``), the authenticated control channel
(``channel``), the worker's environment (``env``), the recovery settings handed to workers
(``recovery``), the keys derived from the job's secret (``keys``), the rendezvous store
(``store``) and the values that cross a socket (``values``)."""
