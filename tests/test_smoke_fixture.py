def test_fixture(db):
    assert db.execute("select flowly.start('x')").fetchone()[0]
