//! The demand-weighted share (DESIGN §4) as the grant statement decides it:
//! `quota_share_tokens` and `quota_available` on a real PostgreSQL with the
//! allocator's migrations applied. These are the share rule's table tests;
//! the rule has no other implementation.

use quota_tests::pg::TestDb;
use sqlx::PgPool;

/// Another active region: its latest demand and want.
struct Other {
    demand: f64,
    want: i64,
}

/// `quota_share_tokens` with chunk_min 10, chunk_max 500 and limit 1000,
/// the shape every case below uses.
async fn tokens(db: &PgPool, want: i64, demand: f64, available: i64, holding: i64, others: &[Other]) -> i64 {
    let demands: Vec<f64> = others.iter().map(|o| o.demand).collect();
    let wants: Vec<i64> = others.iter().map(|o| o.want).collect();
    sqlx::query_scalar("select quota_share_tokens($1, $2, 10, 500, 1000, $3, $4, $5, $6)")
        .bind(want)
        .bind(demand)
        .bind(available)
        .bind(holding)
        .bind(demands)
        .bind(wants)
        .fetch_one(db)
        .await
        .expect("quota_share_tokens")
}

async fn migrated() -> (TestDb, PgPool) {
    let test_db = TestDb::start().await;
    let db = PgPool::connect(&test_db.url).await.expect("connect");
    allocator::MIGRATOR.run(&db).await.expect("migrations");
    (test_db, db)
}

#[tokio::test]
async fn the_share_rule_in_sql() {
    let (_test_db, db) = migrated().await;

    // Uncontended requests get their want, up to chunk_max.
    assert_eq!(tokens(&db, 120, 5.0, 1000, 0, &[]).await, 120);
    assert_eq!(tokens(&db, 900, 5.0, 1000, 0, &[]).await, 500);

    // Never above what is available, and 0 when nothing is.
    assert_eq!(tokens(&db, 120, 5.0, 30, 0, &[]).await, 30);
    assert_eq!(tokens(&db, 120, 5.0, 0, 0, &[]).await, 0);
    assert_eq!(tokens(&db, 120, 5.0, -40, 0, &[]).await, 0);

    // Contention shares the limit by demand: EU (demand 2000 vs 500) is
    // entitled to 800 and holds 600; US is entitled to 200 and holds 150.
    let us = [Other { demand: 500.0, want: 150 }];
    assert_eq!(tokens(&db, 500, 2000.0, 250, 600, &us).await, 200);
    let eu = [Other { demand: 2000.0, want: 500 }];
    assert_eq!(tokens(&db, 150, 500.0, 50, 150, &eu).await, 50);

    // Under contention, never below min(want, chunk_min) while tokens remain.
    let busy = [Other { demand: 1000.0, want: 500 }];
    assert_eq!(tokens(&db, 100, 1.0, 200, 900, &busy).await, 10);
    assert_eq!(tokens(&db, 5, 1.0, 200, 900, &busy).await, 5);

    // A region with no demand gets at most chunk_min.
    assert_eq!(tokens(&db, 300, 0.0, 1000, 0, &[]).await, 10);

    // Nobody states demand under contention: the limit splits evenly.
    let idle = [Other { demand: 0.0, want: 600 }];
    assert_eq!(tokens(&db, 600, 0.0, 400, 0, &idle).await, 10);

    // Wants near i64::MAX do not overflow the outstanding sum.
    let huge = [Other { demand: 1.0, want: i64::MAX }];
    assert_eq!(tokens(&db, 100, 1.0, 1000, 0, &huge).await, 100);
}

#[tokio::test]
async fn the_available_twins_agree() {
    let (_test_db, db) = migrated().await;
    for (limit, granted, returned, owed) in
        [(1000, 400, 100, 200), (1000, 1000, 0, 200), (1000, 900, 0, 200), (500, 800, 0, 0), (10, 0, 0, 0)]
    {
        let sql: i64 = sqlx::query_scalar("select quota_available($1, $2, $3, $4)")
            .bind(limit)
            .bind(granted)
            .bind(returned)
            .bind(owed)
            .fetch_one(&db)
            .await
            .expect("quota_available");
        assert_eq!(
            sql,
            allocator::share::available(limit, granted, returned, owed),
            "{limit} {granted} {returned} {owed}"
        );
    }
}
