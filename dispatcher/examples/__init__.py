"""Example code shipped with the dispatcher: the payments service and fake PSP of the demo.

Under `dispatcher` (not `outbox`) because it uses the dispatcher's handlers, and
`outbox/` never imports `dispatcher/`; never a top-level `examples` package, a name
other distributions install too.
"""
