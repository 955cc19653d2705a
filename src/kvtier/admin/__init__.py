"""The HTTP admin API and live dashboard (:mod:`kvtier.admin.server`).

Start one by hand next to an open engine::

    from kvtier.admin.server import AdminServer
    server = AdminServer(engine, host="127.0.0.1", port=0, token=None).open()
    print(server.url)      # http://127.0.0.1:<port>/ is the dashboard
    server.close()         # idempotent

or let :class:`kvtier.service.Service` do it with ``internal_api_server_enabled: true``.
"""
