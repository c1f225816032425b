"""A local stand-in for the few Grafana HTTP API endpoints ``runwatch grafana provision`` calls.

No Grafana server can be installed on the test machines, so the provisioning is checked against this:
``http.server`` in a thread on a free loopback port, keeping its state in memory the way Grafana does
(numeric ids, uids, versions that go up on each save, secure fields stored but never returned), checking
the ``Authorization: Bearer`` header on every call, and recording every request. What it answers, and
its error bodies, follow Grafana's HTTP API documentation (folder, data source and dashboard APIs,
Grafana 10/11):

- ``GET /api/folders/{uid}``, ``POST /api/folders``, ``PUT /api/folders/{uid}``
- ``GET /api/datasources/uid/{uid}``, ``GET /api/datasources/name/{name}``, ``POST /api/datasources``,
  ``PUT /api/datasources/uid/{uid}``
- ``GET /api/dashboards/uid/{uid}``, ``POST /api/dashboards/db``
- ``GET /api/search`` (``query``, ``type``, ``folderUIDs``, ``dashboardUIDs``)

Anything else is a 404 and stays in the record, so a test can assert the command called nothing else.
Tokens: ``admin_token`` may do everything, ``viewer_token`` only read (a write is 403, as for a Viewer
service account); any other is 401. ``garbage = True`` makes every answer an HTML page (a proxy's
error page, say), for the bad-response path.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse


@dataclass
class Request:
    """One request as the stand-in saw it."""

    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    authorization: str | None
    status: int = 0

    @property
    def is_write(self) -> bool:
        return self.method not in ("GET", "HEAD")


@dataclass
class GrafanaState:
    """What Grafana would hold: folders, datasources and dashboards by uid."""

    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)
    secure: dict[str, dict[str, str]] = field(default_factory=dict)  # datasource uid -> secureJsonData
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> {dashboard, folderUid}
    next_id: int = 1

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


class GrafanaStandIn:
    """Start with ``start()`` (or as a context manager); ``url`` is its base URL."""

    def __init__(self, admin_token: str = "admin-token", viewer_token: str = "viewer-token") -> None:
        self.admin_token = admin_token
        self.viewer_token = viewer_token
        self.state = GrafanaState()
        self.requests: list[Request] = []
        self.garbage = False
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> GrafanaStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                parsed = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                request = Request(
                    self.command,
                    unquote(parsed.path),
                    parse_qs(parsed.query),
                    body,
                    self.headers.get("Authorization"),
                )
                with standin.lock:
                    standin.requests.append(request)
                    status, answer = standin.answer(request)
                    request.status = status
                if standin.garbage:
                    payload, content_type = b"<html><body>502 Bad Gateway</body></html>", "application/json"
                    status = 200
                else:
                    payload, content_type = json.dumps(answer).encode(), "application/json"
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="grafana-standin", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> GrafanaStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the API -------------------------------------------------------------------------------
    def answer(self, r: Request) -> tuple[int, Any]:
        """Grafana's status and JSON body for ``r`` (the caller holds the lock)."""
        token = (r.authorization or "").removeprefix("Bearer ")
        if token not in (self.admin_token, self.viewer_token) or not (r.authorization or "").startswith(
            "Bearer "
        ):
            return 401, {"message": "invalid API key", "messageId": "api-keys.invalid", "statusCode": 401}
        if r.is_write and token != self.admin_token:
            return 403, {
                "message": "You'll need additional permissions to perform this action. "
                "Permissions needed: any of datasources:create",
                "accessErrorId": "ACE0000000001",
            }
        routes = [
            ("GET", r"/api/folders/([^/]+)", self.get_folder),
            ("POST", r"/api/folders", self.create_folder),
            ("PUT", r"/api/folders/([^/]+)", self.update_folder),
            ("GET", r"/api/datasources/uid/([^/]+)", self.get_datasource_by_uid),
            ("GET", r"/api/datasources/name/(.+)", self.get_datasource_by_name),
            ("POST", r"/api/datasources", self.create_datasource),
            ("PUT", r"/api/datasources/uid/([^/]+)", self.update_datasource),
            ("GET", r"/api/dashboards/uid/([^/]+)", self.get_dashboard),
            ("POST", r"/api/dashboards/db", self.save_dashboard),
            ("GET", r"/api/search", self.search),
        ]
        for method, pattern, handler in routes:
            match = re.fullmatch(pattern, r.path)
            if method == r.method and match:
                return handler(r, *match.groups())
        return 404, {"message": "Not found"}

    def get_folder(self, r: Request, uid: str) -> tuple[int, Any]:
        folder = self.state.folders.get(uid)
        return (200, folder) if folder else (404, {"message": "folder not found", "status": "not-found"})

    def create_folder(self, r: Request) -> tuple[int, Any]:
        body = r.body or {}
        title, uid = body.get("title"), body.get("uid") or f"f{self.state.next_id}"
        if not title:
            return 400, {"message": "folder title cannot be empty"}
        if uid in self.state.folders:
            return 409, {"message": "a folder with the same uid already exists"}
        if any(f["title"] == title for f in self.state.folders.values()):
            return 409, {
                "message": "a folder or dashboard in the general folder with the same name already exists"
            }
        folder = {
            "id": self.state.new_id(),
            "uid": uid,
            "title": title,
            "url": f"/dashboards/f/{uid}/",
            "hasAcl": False,
            "canSave": True,
            "canEdit": True,
            "canAdmin": True,
            "version": 1,
        }
        self.state.folders[uid] = folder
        return 200, folder

    def update_folder(self, r: Request, uid: str) -> tuple[int, Any]:
        folder = self.state.folders.get(uid)
        if folder is None:
            return 404, {"message": "folder not found", "status": "not-found"}
        body = r.body or {}
        if not body.get("overwrite") and body.get("version") != folder["version"]:
            return 412, {
                "message": "the folder has been changed by someone else",
                "status": "version-mismatch",
            }
        folder.update(title=body.get("title", folder["title"]), version=folder["version"] + 1)
        return 200, folder

    def get_datasource_by_uid(self, r: Request, uid: str) -> tuple[int, Any]:
        found = self.state.datasources.get(uid)
        return (200, found) if found else (404, {"message": "Data source not found"})

    def get_datasource_by_name(self, r: Request, name: str) -> tuple[int, Any]:
        found = next((d for d in self.state.datasources.values() if d["name"] == name), None)
        return (200, found) if found else (404, {"message": "Data source not found"})

    def _stored_datasource(self, body: dict[str, Any], ds_id: int, version: int) -> dict[str, Any]:
        secure = body.get("secureJsonData") or {}
        return {
            "id": ds_id,
            "uid": body["uid"],
            "orgId": 1,
            "name": body["name"],
            "type": body["type"],
            "typeLogoUrl": "public/plugins/grafana-clickhouse-datasource/img/logo.svg",
            "access": body.get("access", "proxy"),
            "url": body.get("url", ""),
            "user": body.get("user", ""),
            "database": body.get("database", ""),
            "basicAuth": bool(body.get("basicAuth")),
            "basicAuthUser": "",
            "withCredentials": False,
            "isDefault": bool(body.get("isDefault")),
            "jsonData": copy.deepcopy(body.get("jsonData") or {}),
            "secureJsonFields": {key: True for key in secure},
            "version": version,
            "readOnly": False,
        }

    def create_datasource(self, r: Request) -> tuple[int, Any]:
        body = r.body or {}
        if not body.get("name") or not body.get("type"):
            return 400, {"message": "bad request data"}
        if any(d["name"] == body["name"] for d in self.state.datasources.values()):
            return 409, {"message": "data source with the same name already exists"}
        uid = body.get("uid") or f"ds{self.state.next_id}"
        if uid in self.state.datasources:
            return 409, {"message": "data source with the same uid already exists"}
        stored = self._stored_datasource({**body, "uid": uid}, self.state.new_id(), 1)
        self.state.datasources[uid] = stored
        self.state.secure[uid] = dict(body.get("secureJsonData") or {})
        return 200, {
            "datasource": stored,
            "id": stored["id"],
            "message": "Datasource added",
            "name": stored["name"],
        }

    def update_datasource(self, r: Request, uid: str) -> tuple[int, Any]:
        current = self.state.datasources.get(uid)
        if current is None:
            return 404, {"message": "Data source not found"}
        body = r.body or {}
        if "version" in body and body["version"] != current["version"]:
            return 409, {
                "message": "Datasource has already been updated by someone else. Please reload and try again"
            }
        secure = {**self.state.secure.get(uid, {}), **(body.get("secureJsonData") or {})}
        stored = self._stored_datasource(
            {**body, "uid": uid, "secureJsonData": secure}, current["id"], current["version"] + 1
        )
        self.state.datasources[uid] = stored
        self.state.secure[uid] = secure
        return 200, {
            "datasource": stored,
            "id": stored["id"],
            "message": "Datasource updated",
            "name": stored["name"],
        }

    def get_dashboard(self, r: Request, uid: str) -> tuple[int, Any]:
        entry = self.state.dashboards.get(uid)
        if entry is None:
            return 404, {"message": "Dashboard not found"}
        folder = self.state.folders.get(entry["folderUid"] or "", {})
        dashboard = entry["dashboard"]
        meta = {
            "type": "db",
            "canSave": True,
            "canEdit": True,
            "slug": _slug(dashboard["title"]),
            "url": f"/d/{uid}/{_slug(dashboard['title'])}",
            "version": dashboard["version"],
            "folderId": folder.get("id", 0),
            "folderUid": entry["folderUid"] or "",
            "folderTitle": folder.get("title", "General"),
            "provisioned": False,
        }
        return 200, {"dashboard": copy.deepcopy(dashboard), "meta": meta}

    def save_dashboard(self, r: Request) -> tuple[int, Any]:
        body = r.body or {}
        dashboard = copy.deepcopy(body.get("dashboard") or {})
        if not dashboard.get("title"):
            return 400, {"message": "Dashboard title cannot be empty"}
        folder_uid = body.get("folderUid") or ""
        if folder_uid and folder_uid not in self.state.folders:
            return 400, {"message": "folder not found"}
        uid = dashboard.get("uid") or f"d{self.state.next_id}"
        existing = self.state.dashboards.get(uid)
        for other_uid, other in self.state.dashboards.items():
            if (
                other_uid != uid
                and other["folderUid"] == folder_uid
                and other["dashboard"]["title"] == dashboard["title"]
            ):
                return 412, {
                    "message": "A dashboard with the same name in the folder already exists",
                    "status": "name-exists",
                }
        if (
            existing is not None
            and not body.get("overwrite")
            and dashboard.get("version") != existing["dashboard"]["version"]
        ):
            return 412, {
                "message": "The dashboard has been changed by someone else",
                "status": "version-mismatch",
            }
        if existing is None and dashboard.get("id") is not None:
            return 404, {"message": "Dashboard not found"}
        version = existing["dashboard"]["version"] + 1 if existing else 1
        dashboard.update(
            id=existing["dashboard"]["id"] if existing else self.state.new_id(), uid=uid, version=version
        )
        self.state.dashboards[uid] = {
            "dashboard": dashboard,
            "folderUid": folder_uid,
            "message": body.get("message"),
        }
        return 200, {
            "id": dashboard["id"],
            "uid": uid,
            "url": f"/d/{uid}/{_slug(dashboard['title'])}",
            "status": "success",
            "version": version,
            "slug": _slug(dashboard["title"]),
        }

    def search(self, r: Request) -> tuple[int, Any]:
        query = (r.query.get("query") or [""])[0].lower()
        kind = (r.query.get("type") or [""])[0]
        folder_uids = set(r.query.get("folderUIDs") or [])
        uids = set(r.query.get("dashboardUIDs") or [])
        hits: list[dict[str, Any]] = []
        if kind in ("", "dash-folder"):
            hits += [
                {
                    "id": f["id"],
                    "uid": f["uid"],
                    "title": f["title"],
                    "type": "dash-folder",
                    "url": f["url"],
                    "tags": [],
                    "isStarred": False,
                }
                for f in self.state.folders.values()
                if query in f["title"].lower() and not folder_uids and (not uids or f["uid"] in uids)
            ]
        if kind in ("", "dash-db"):
            for uid, entry in self.state.dashboards.items():
                d, folder = entry["dashboard"], self.state.folders.get(entry["folderUid"], {})
                if (
                    query in d["title"].lower()
                    and (not folder_uids or entry["folderUid"] in folder_uids)
                    and (not uids or uid in uids)
                ):
                    hits.append(
                        {
                            "id": d["id"],
                            "uid": uid,
                            "title": d["title"],
                            "type": "dash-db",
                            "url": f"/d/{uid}/{_slug(d['title'])}",
                            "tags": d.get("tags", []),
                            "isStarred": False,
                            "folderUid": entry["folderUid"],
                            "folderTitle": folder.get("title", "General"),
                        }
                    )
        return 200, sorted(hits, key=lambda h: h["title"])


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
