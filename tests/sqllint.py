"""Reading flowly's SQL files with pglast (a real PostgreSQL parser), for tests.

Helpers to parse ``sql/`` the way PostgreSQL would, and lint rules that a grep cannot check
reliably because they depend on the parse tree: which CREATE FUNCTION has a ``SET
search_path`` clause, and which names are schema-qualified, including inside PL/pgSQL and SQL
function bodies (whose text the outer parse leaves as a string).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pglast
from pglast import ast
from pglast.enums import VariableSetKind

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
INSTALL_SQL = SQL_DIR / "install.sql"

# What the psql variable uses of install.sql become, so the rest parses as plain SQL.
PLACEHOLDER_SCHEMA = "flowly_placeholder_schema"

_META_LINE = re.compile(r"^\s*\\")
_TRAILING_GSET = re.compile(r"\\gset\b[^\n]*$", re.MULTILINE)
_INCLUDE = re.compile(r"^\s*\\(?:ir|include_relative|i|include)\s+(\S+)\s*$", re.MULTILINE)


def migration_files() -> list[Path]:
    """The numbered migration files, in version order."""
    return sorted(p for p in MIGRATIONS_DIR.glob("*.sql") if re.match(r"\d{4}_", p.name))


def psql_script_as_sql(text: str) -> str:
    """Turn a psql script into plain SQL: drop meta-command lines, end ``\\gset`` queries with
    ``;`` and replace the ``:"schema"`` / ``:'schema'`` variable uses by a placeholder
    identifier / literal."""
    lines = [line for line in text.splitlines() if not _META_LINE.match(line)]
    plain = _TRAILING_GSET.sub(";", "\n".join(lines))
    plain = plain.replace(':"schema"', f'"{PLACEHOLDER_SCHEMA}"')
    return plain.replace(":'schema'", f"'{PLACEHOLDER_SCHEMA}'")


def psql_includes(text: str) -> list[str]:
    """The files a psql script includes with ``\\i`` / ``\\ir``, in order."""
    return _INCLUDE.findall(text)


def walk(node: Any) -> Iterator[ast.Node]:
    """Every pglast AST node in ``node`` (a node, or a tuple/list of them), depth first."""
    if isinstance(node, (list, tuple)):
        for item in node:
            yield from walk(item)
    elif isinstance(node, ast.Node):
        yield node
        for slot in node.__slots__:
            yield from walk(getattr(node, slot, None))


def _option(stmt: ast.CreateFunctionStmt, name: str) -> Any:
    for option in stmt.options or ():
        if option.defname == name:
            return option.arg
    return None


def function_name(stmt: ast.CreateFunctionStmt) -> str:
    """The function's (possibly qualified) name as written."""
    return ".".join(part.sval for part in stmt.funcname)


def function_language(stmt: ast.CreateFunctionStmt) -> str:
    """The function's LANGUAGE (``sql`` when the clause is missing, as Postgres assumes)."""
    language = _option(stmt, "language")
    return language.sval.lower() if language is not None else "sql"


def search_path_setting(stmt: ast.CreateFunctionStmt) -> ast.VariableSetStmt | None:
    """The function's ``SET search_path ...`` clause, or None."""
    for option in stmt.options or ():
        if (option.defname == "set" and isinstance(option.arg, ast.VariableSetStmt)
                and option.arg.name == "search_path"
                and option.arg.kind in (VariableSetKind.VAR_SET_CURRENT,
                                        VariableSetKind.VAR_SET_VALUE)):
            return option.arg
    return None


@dataclass
class Statement:
    """One top-level statement of a file, with its source text."""

    node: ast.Node
    text: str


def statements(text: str) -> list[Statement]:
    """Parse ``text`` and return its statements with their exact source slices."""
    data = text.encode()
    found = []
    for raw in pglast.parse_sql(text):
        start = raw.stmt_location or 0
        end = start + raw.stmt_len if raw.stmt_len else len(data)
        found.append(Statement(raw.stmt, data[start:end].decode()))
    return found


def _plpgsql_queries(tree: Any) -> Iterator[str]:
    """Every SQL expression or statement embedded in a parse_plpgsql tree, as parseable SQL.

    PL/pgSQL keeps bare expressions (``if x then``) and assignments (``v := x``) apart from
    full statements; they become ``select x`` so the SQL parser accepts them.
    """
    if isinstance(tree, dict):
        expr = tree.get("PLpgSQL_expr")
        if isinstance(expr, dict) and "query" in expr:
            query, mode = expr["query"], expr.get("parseMode", 0)
            if mode == 0:
                yield query
            elif mode == 2:
                yield "select " + query
            else:  # assignment: target := expression
                yield "select " + query.split(":=", 1)[1]
        for value in tree.values():
            yield from _plpgsql_queries(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _plpgsql_queries(value)


def _plpgsql_type_names(tree: Any) -> Iterator[str]:
    """The declared variable types of a parse_plpgsql tree (``v_run flowly.runs;``)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key == "PLpgSQL_type" and isinstance(value, dict) and "typname" in value:
                yield value["typname"]
            else:
                yield from _plpgsql_type_names(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _plpgsql_type_names(value)


@dataclass
class Body:
    """The parsed body of a function or DO block."""

    owner: str
    nodes: list[ast.Node]
    declared_types: list[str]
    # why part of the body could not be read (libpg_query's PL/pgSQL parser only resolves
    # declared types in pg_catalog and public: another schema's type is an error there)
    unreadable: str | None = None


def _plpgsql_body(owner: str, function_text: str) -> Body:
    try:
        tree = pglast.parse_plpgsql(function_text)
    except pglast.parser.ParseError as error:
        if "LookupExplicitNamespace" not in str(error):
            raise
        return Body(owner, [], [], unreadable=str(error))
    return Body(owner, [n for q in _plpgsql_queries(tree) for n in pglast.parse_sql(q)],
                list(_plpgsql_type_names(tree)))


def bodies(stmt: Statement) -> list[Body]:
    """Parse the body of a CREATE FUNCTION / DO statement (SQL or PL/pgSQL) into SQL trees."""
    node = stmt.node
    if isinstance(node, ast.DoStmt):
        code = next(o.arg.sval for o in node.args if o.defname == "as")
        language = next((o.arg.sval for o in node.args if o.defname == "language"), "plpgsql")
        if language.lower() != "plpgsql":
            return []
        wrapped = ("create function pg_temp.do_block() returns void language plpgsql as "
                   f"$do_block$ {code} $do_block$")
        return [_plpgsql_body("DO block", wrapped)]
    if not isinstance(node, ast.CreateFunctionStmt):
        return []
    name = function_name(node)
    if node.sql_body is not None:  # BEGIN ATOMIC: already part of the tree
        return [Body(name, [node.sql_body], [])]
    code = "".join(part.sval for part in _option(node, "as") or ())
    language = function_language(node)
    if language == "sql":
        return [Body(name, list(pglast.parse_sql(code)), [])]
    if language == "plpgsql":
        return [_plpgsql_body(name, stmt.text)]
    return []


def functions_without_search_path(text: str) -> list[str]:
    """Names of the functions/procedures ``text`` creates without a SET search_path clause."""
    return [function_name(s.node) for s in statements(text)
            if isinstance(s.node, ast.CreateFunctionStmt) and search_path_setting(s.node) is None]


# functions whose first argument, given as a string literal, is an object name
_NAME_TAKING = {"nextval", "currval", "setval", "to_regclass", "to_regproc", "to_regprocedure",
                "to_regtype", "to_regnamespace", "to_regoper", "to_regoperator"}


def _qualified_names(nodes: Any) -> Iterator[tuple[str, ...]]:
    """Every dotted name in the trees: relations, functions, types, columns, operators."""
    for node in walk(nodes):
        if isinstance(node, ast.RangeVar) and node.schemaname:
            yield (node.schemaname, node.relname)
        elif isinstance(node, ast.CreateSchemaStmt) and node.schemaname:
            yield (node.schemaname,)
        elif (isinstance(node, ast.FuncCall) and node.funcname[-1].sval in _NAME_TAKING
              and node.args and isinstance(node.args[0], ast.A_Const)
              and isinstance(node.args[0].val, ast.String)):
            # nextval('flowly.step_seq'): the text is resolved as a name when it runs
            yield tuple(node.args[0].val.sval.split("."))
        elif isinstance(node, ast.TypeCast) and isinstance(node.arg, ast.A_Const):
            # 'flowly.runs'::regclass and friends name objects inside a string
            value = node.arg.val
            type_name = node.typeName.names[-1].sval if node.typeName else ""
            if isinstance(value, ast.String) and type_name.startswith("reg"):
                yield tuple(value.sval.split("."))
        for slot in node.__slots__:
            value = getattr(node, slot, None)
            if (isinstance(value, tuple) and len(value) >= 2
                    and all(isinstance(part, ast.String) for part in value)):
                yield tuple(part.sval for part in value)


def hard_coded_schema_references(text: str, schema: str = "flowly") -> list[str]:
    """Every place ``text`` (bodies of functions and DO blocks included) names an object
    qualified with the hard-coded ``schema``, as ``"where: a.b"`` strings."""
    found = []
    for stmt in statements(text):
        where = type(stmt.node).__name__
        for name in _qualified_names(stmt.node):
            if name[0] == schema:
                found.append(f"{where}: {'.'.join(name)}")
        for body in bodies(stmt):
            for name in _qualified_names(body.nodes):
                if name[0] == schema:
                    found.append(f"{body.owner} body: {'.'.join(name)}")
            if body.unreadable:  # a declared type qualified with a schema other than public
                found.append(f"{body.owner} declaration (unreadable body): {body.unreadable}")
            for type_name in body.declared_types:
                if type_name.split(".")[0].strip('"') == schema and "." in type_name:
                    found.append(f"{body.owner} declaration: {type_name}")
    return found
