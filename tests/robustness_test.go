package tests

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The robustness driver: on a 3-member cluster, workers lock, try-lock and
// campaign on one name (a Mutex and an Election on one name exclude each
// other), read- and write-lock an RWMutex on another, take permits of a
// Semaphore on a third, and, while they hold, read and write a register
// through their guard (writers only, on the RWMutex's; none on the
// Semaphore's, whose holders share it), and each runs a member of a Shards
// that leaves and joins again, whose fns write their shard's register
// through the shard's fencing token, while a seeded random schedule of
// faults strikes. Each name's history is checked against a model of how
// much may hold at once: a mutex, readers sharing and a writer alone,
// permits within the capacity, each shard's fn on one member at a time.
// Every operation is recorded with its invocation and response times, and
// the histories are checked with porcupine: the lock's (a mutex: no two
// holds at once, as the library reported them) and the register's (each
// hold's read-then-write takes effect on the value it read: a lost update
// means two writers).
// Fencing tokens never go back in the order writes committed, and the holds
// are checked against the server's revisions as in the fault suite.

var (
	robustnessFor  = flag.Duration("robustness", 0, "robustness driver: run rounds of faults for this long (0: one short round)")
	robustnessSeed = flag.Uint64("seed", 0, "robustness driver: seed of the first round's schedule (0: from the clock)")
)

const (
	robustShort   = 12 * time.Second // the round go test runs
	robustRound   = 30 * time.Second // each round of a long run
	robustLong    = time.Minute      // how long the rounds of go test -tags long run
	robustWorkers = 4
	robustName    = "robust/lock"
	robustReg     = "robust/register"
	robustRW      = "robust/rw"
	robustRWReg   = "robust/rw-register"
	robustSem     = "robust/sem"
	robustShards  = "robust/shards"
	robustShardsN = 4                        // shards of robustShards
	robustShardRg = "robust/shard-register/" // + i: shard i's register
)

func TestRobustness(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("robustness driver skipped in -short")
	}
	seed := *robustnessSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	runFor := *robustnessFor
	if runFor == 0 && longRuns {
		runFor = robustLong
	}
	length := robustShort
	if runFor > 0 {
		length = robustRound
	}
	start := time.Now()
	var histories, ops int
	for i := uint64(0); ; i++ {
		s := seed + i
		ok := t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) {
			t.Logf("replay: go test -run 'TestRobustness' -seed %d", s)
			ops += robustRun(t, s, length)
			histories += 2
		})
		if !ok || time.Since(start)+length > runFor {
			break
		}
	}
	t.Logf("checked %d histories (a lock and a register per round), %d operations", histories, ops)
}

// robustRun runs one round: faults for length, then the checks. It returns
// the number of operations checked.
func robustRun(t *testing.T, seed uint64, length time.Duration) int {
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx, cancel := context.WithTimeout(context.Background(), length+3*time.Minute)
	defer cancel()
	admin := c.Client(t)
	_, err := admin.Put(ctx, robustReg, "init")
	require.NoError(t, err)
	for i := range robustShardsN {
		_, err := admin.Put(ctx, robustShardRg+strconv.Itoa(i), "init")
		require.NoError(t, err)
	}
	put, err := admin.Put(ctx, robustRWReg, "init")
	require.NoError(t, err)
	h := &history{base: time.Now(), admin: make(map[int64]bool), fams: []*family{
		{name: robustName, reg: robustReg, capacity: 1},
		{name: robustRW, reg: robustRWReg, capacity: robustWorkers},
		{name: robustSem, capacity: faultPermits},
	}}
	for i := range robustShardsN { // after the others, which robustPrimitive finds by index
		f := &family{name: etcdsync.ShardName(robustShards, i), reg: robustShardRg + strconv.Itoa(i), capacity: 1}
		h.shards = append(h.shards, f)
		h.fams = append(h.fams, f)
	}
	for _, f := range h.fams {
		f.log = watchDeletes(ctx, admin, f.name+"/", put.Header.Revision+1)
	}
	log := h.fams[0].log
	workers := make([]*faultWorker, robustWorkers)
	for i := range workers {
		workers[i] = newFaultWorker(t, c, i)
	}
	wctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i, w := range workers {
		wg.Add(2)
		go func() {
			defer wg.Done()
			robustWork(t, ctx, wctx, w, rand.New(rand.NewPCG(seed, uint64(i)+1)), h)
		}()
		go func() {
			defer wg.Done()
			robustShardsMember(t, ctx, wctx, w, seed, rand.New(rand.NewPCG(seed, uint64(robustWorkers+i)+1)), h)
		}()
	}
	driveFaults(t, ctx, c, admin, workers, log, h, rand.New(rand.NewPCG(seed, 0)), length)
	stop()
	wg.Wait()
	for _, w := range workers {
		w.close()
	}

	// Every key goes with its session (a session that lost contact leaves
	// its lease to expire), and every delete is seen before the checks.
	waitCount(t, admin, robustShards+"/", faultTTL+testTimeout, func(have int) bool { return have == 0 }) // the members too
	for _, f := range h.fams {
		waitCount(t, admin, f.name+"/", faultTTL+testTimeout, func(have int) bool { return have == 0 })
		resp, err := admin.Get(ctx, f.name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		require.NoError(t, err)
		require.Zero(t, resp.Count, "keys left under %s", f.name)
		f.log.stop(t, resp.Header.Revision)
	}

	h.mu.Lock()
	defer h.mu.Unlock()
	dir := ""
	check := func(what string, model porcupine.Model, ops []porcupine.Operation) {
		end := h.now()
		for i := range ops {
			if ops[i].Return < 0 { // outcome unknown: it may take effect at any later time
				ops[i].Return = end
			}
		}
		res, info := porcupine.CheckOperationsVerbose(model, ops, time.Minute)
		if res == porcupine.Ok {
			return
		}
		if dir == "" {
			d, err := os.MkdirTemp("", "etcdsync-robustness-")
			require.NoError(t, err)
			dir = d
		}
		path := filepath.Join(dir, what+".html")
		require.NoError(t, porcupine.VisualizePath(model, info, path))
		t.Errorf("%s history (%d operations): %s; see %s", what, len(ops), res, path)
	}
	ops := 0
	for _, f := range h.fams {
		what := strings.ReplaceAll(f.name, "/", "-")
		check(what, holdsModel(f.capacity), append(f.acquires, h.releaseOps(f)...))
		if f.reg != "" {
			check(what+"-register", registerModel, f.regOps)
			slices.SortFunc(f.writes, func(a, b incRec) int { return int(a.commit - b.commit) })
			for i := 1; i < len(f.writes); i++ {
				if f.writes[i].token < f.writes[i-1].token {
					t.Errorf("%s: fencing token went back: %d after %d", f.name, f.writes[i].token, f.writes[i-1].token)
				}
			}
		}
		problems, leads := checkHolds(f.holds, f.log, faultTTL, f.capacity, h.byAdmin)
		for _, p := range problems {
			t.Errorf("%s: %s", f.name, p)
		}
		t.Logf("%s: %d holds (%d lost), %d guarded writes, %d lock and %d register operations", f.name, len(f.holds), len(leads), len(f.writes), len(f.acquires)+len(f.releases), len(f.regOps))
		ops += len(f.acquires) + len(f.releases) + len(f.regOps)
	}
	require.NotEmpty(t, h.fams[0].writes, "no guarded write succeeded")
	require.True(t, slices.ContainsFunc(h.shards, func(f *family) bool { return len(f.writes) > 0 }), "no shard's fn made a guarded write")
	return ops
}

// history is what the workers did, with times in nanoseconds since base.
type history struct {
	base   time.Time
	mu     sync.Mutex
	admin  map[int64]bool // revisions of the admin's deletes and revokes
	fams   []*family      // the lock's, the RWMutex's, the Semaphore's, then the shards'
	shards []*family      // each shard's of the Shards, by shard (also in fams)
}

// family is one name the workers contend on, and its history (h.mu).
type family struct {
	name     string
	reg      string // the register its holds write through their guard, or ""
	capacity int64  // weight that may hold at once (holdsModel)
	log      *deleteLog
	acquires []porcupine.Operation // input lockOp
	releases []releaseRec
	regOps   []porcupine.Operation // input regOp
	writes   []incRec              // guarded writes that committed: fencing token, revision
	holds    []holdRec
}

// releaseRec is how a hold ended: by its release (Unlock or Resign, from
// call to ret), or lost.
type releaseRec struct {
	worker             int
	rev, weight        int64
	lost               bool
	acquire, call, ret int64 // acquire: when its Lock or Campaign was called
}

// releaseOps returns the release operations of the lock history. A hold
// that was lost, or whose key an admin's delete or revoke took (perhaps
// while its release was in flight: the library then reports a release),
// ended on the server at some time after its acquire began (perhaps before
// the acquire returned: a hold can be lost at any moment); whether that was
// in time is checkHolds' part, against the server's revisions.
func (h *history) releaseOps(f *family) []porcupine.Operation {
	var ops []porcupine.Operation
	for _, r := range f.releases {
		op := porcupine.Operation{ClientId: r.worker, Input: lockOp{rev: r.rev, weight: r.weight}, Call: r.call, Return: r.ret}
		if del, ok := f.log.get(r.rev); r.lost || ok && h.admin[del.rev] {
			op.Call, op.Return = r.acquire, -1
		}
		ops = append(ops, op)
	}
	return ops
}

// adminDid records the revision of an admin's delete or revoke.
func (h *history) adminDid(hdr *pb.ResponseHeader) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.admin[hdr.Revision] = true
}

// byAdmin reports whether rev is the revision of an admin's delete or
// revoke. The caller holds h.mu (the checks after a round do).
func (h *history) byAdmin(rev int64) bool { return h.admin[rev] }

func (h *history) now() int64 { return int64(time.Since(h.base)) }

func (h *history) add(ops *[]porcupine.Operation, op porcupine.Operation) {
	h.mu.Lock()
	defer h.mu.Unlock()
	*ops = append(*ops, op)
}

// lockOp takes (acquire) or gives up the hold whose key has create revision
// rev and weight weight.
type lockOp struct {
	acquire     bool
	rev, weight int64
}

// holdsModel: the state is the holds in place, as "rev:weight" sorted by
// rev, joined by spaces; an acquire fits when the weights in place and its
// own are within capacity (1 and weights of 1: a mutex; readers 1 and a
// writer the capacity: a read/write lock; a Semaphore's permits).
func holdsModel(capacity int64) porcupine.Model {
	parse := func(state string) map[int64]int64 {
		held := map[int64]int64{}
		for _, f := range strings.Fields(state) {
			var rev, w int64
			fmt.Sscanf(f, "%d:%d", &rev, &w)
			held[rev] = w
		}
		return held
	}
	format := func(held map[int64]int64) string {
		revs := slices.Sorted(maps.Keys(held))
		var out []string
		for _, rev := range revs {
			out = append(out, fmt.Sprintf("%d:%d", rev, held[rev]))
		}
		return strings.Join(out, " ")
	}
	return porcupine.Model{
		Init: func() any { return "" },
		Step: func(state, input, _ any) (bool, any) {
			held, op := parse(state.(string)), input.(lockOp)
			if op.acquire {
				sum := op.weight
				for _, w := range held {
					sum += w
				}
				if _, in := held[op.rev]; in || sum > capacity {
					return false, state
				}
				held[op.rev] = op.weight
				return true, format(held)
			}
			if _, in := held[op.rev]; !in {
				return false, state
			}
			delete(held, op.rev)
			return true, format(held)
		},
		DescribeOperation: func(input, _ any) string {
			if op := input.(lockOp); op.acquire {
				return fmt.Sprintf("acquire %d (weight %d)", op.rev, op.weight)
			} else {
				return fmt.Sprintf("release %d", op.rev)
			}
		},
		DescribeState: func(state any) string { return fmt.Sprintf("held: %q of %d", state, capacity) },
	}
}

// regOp is a guarded read of the register (wrote == "") or a guarded read
// then write in one hold; unknown: the write's outcome was not learned.
type regOp struct {
	read, wrote string
	unknown     bool
}

// registerModel: the state is the register's value. A read-then-write only
// applies to the value it read; one whose outcome is unknown may or may
// not have applied.
var registerModel = (&porcupine.NondeterministicModel{
	Init: func() []any { return []any{"init"} },
	Step: func(state, input, _ any) []any {
		s, op := state.(string), input.(regOp)
		switch {
		case op.wrote == "" || !op.unknown && s != op.read:
			if s != op.read {
				return nil
			}
			return []any{s}
		case !op.unknown:
			return []any{op.wrote}
		case s == op.read:
			return []any{s, op.wrote}
		default:
			return []any{s}
		}
	},
	DescribeOperation: func(input, _ any) string {
		op := input.(regOp)
		switch {
		case op.wrote == "":
			return fmt.Sprintf("read %q", op.read)
		case op.unknown:
			return fmt.Sprintf("read %q, write %q (outcome unknown)", op.read, op.wrote)
		}
		return fmt.Sprintf("read %q, write %q", op.read, op.wrote)
	},
	DescribeState: func(state any) string { return fmt.Sprintf("%q", state) },
}).ToModel()

// robustWork is one worker's loop: acquire one way or another (sometimes
// with so little patience that the acquire is cancelled at any step), do
// guarded reads and writes, release, until work ends (ctx bounds the rest).
func robustWork(t *testing.T, ctx, work context.Context, w *faultWorker, rng *rand.Rand, h *history) {
	for seq := 0; work.Err() == nil; {
		s, err := w.session(ctx)
		if err != nil {
			continue
		}
		f, p := robustPrimitive(rng, s, h)
		patience := 5 * time.Second
		if rng.IntN(4) == 0 {
			patience = time.Duration(1+rng.IntN(300)) * time.Millisecond
		}
		actx, cancel := context.WithTimeout(work, patience)
		call := h.now()
		err = p.acquire(actx)
		cancel()
		if err != nil {
			continue
		}
		granted := h.now()
		rec, ended := recordHold(w.id, p)
		h.add(&f.acquires, porcupine.Operation{ClientId: w.id, Input: lockOp{acquire: true, rev: rec.rev, weight: p.weight}, Call: call, Return: granted})
		for range 1 + rng.IntN(3) {
			seq++
			if f.reg == "" { // the hold's work: a guarded read of its own key
				gctx, gcancel := context.WithTimeout(ctx, 2*faultTTL)
				_, _ = p.Do(gctx, clientv3.OpGet(f.name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly()))
				gcancel()
				continue
			}
			robustGuarded(context.Background(), w, p.Do, f, rec.rev, p.role != readRole && rng.IntN(3) > 0, fmt.Sprintf("w%d-%d", w.id, seq), h)
		}
		release := h.now()
		rec.unlocking = time.Now() // a delete seen from now on may be this release's, its reply lost to a cut (checkHolds)
		w.unlock(ctx, p)
		if !ended(&rec) {
			t.Errorf("worker %d: hold %d: Done never fired", w.id, rec.rev)
			return
		}
		h.mu.Lock()
		f.holds = append(f.holds, rec)
		f.releases = append(f.releases, releaseRec{worker: w.id, rev: rec.rev, weight: p.weight, lost: rec.lost, acquire: call, call: release, ret: h.now()})
		h.mu.Unlock()
	}
}

// robustPrimitive chooses what a worker takes next, and on which name: a
// Mutex (by Lock or TryLock) or an Election on the lock's name, most of the
// time; a reader or a writer of the RWMutex; permits (1 or 2) of the
// Semaphore.
func robustPrimitive(rng *rand.Rand, s *etcdsync.Session, h *history) (*family, primitive) {
	switch kind := rng.IntN(14); {
	case kind >= 12:
		return h.fams[2], newPrimitive(kindSemaphore, s, robustSem, rng.IntN(2))
	case kind >= 10:
		p := newPrimitive(kindRWMutex, s, robustRW, rng.IntN(2))
		if p.role == writeRole {
			p.weight = robustWorkers // alone: the capacity is the workers' count
		}
		return h.fams[1], p
	case kind >= 7:
		return h.fams[0], newPrimitive(kindElection, s, robustName, 0)
	case kind >= 3:
		return h.fams[0], newPrimitive(kindMutex, s, robustName, 0)
	default:
		p := newPrimitive(kindMutex, s, robustName, 0)
		p.acquire = p.held.(*etcdsync.Mutex).TryLock
		return h.fams[0], p
	}
}

// robustGuarded reads the register through a hold's guard (do: its Do)
// and, if write, writes val through it in the same hold (whose fencing
// token is token), within ctx, and records what it saw.
func robustGuarded(ctx context.Context, w *faultWorker, do func(context.Context, ...clientv3.Op) (*clientv3.TxnResponse, error), f *family, token int64, write bool, val string, h *history) {
	ctx, cancel := context.WithTimeout(ctx, 2*faultTTL)
	defer cancel()
	call := h.now()
	resp, err := do(ctx, clientv3.OpGet(f.reg))
	if err != nil {
		return
	}
	op := regOp{read: string(resp.Responses[0].GetResponseRange().Kvs[0].Value)}
	if write {
		tr, err := do(ctx, clientv3.OpPut(f.reg, val))
		switch {
		case err == nil:
			op.wrote = val
			h.mu.Lock()
			f.writes = append(f.writes, incRec{token: token, commit: tr.Header.Revision})
			h.mu.Unlock()
		case errors.Is(err, etcdsync.ErrNotHeld):
			// The guard failed (on the server or before sending): no write.
		default:
			op.wrote, op.unknown = val, true
		}
	}
	ret := h.now()
	if op.unknown {
		ret = -1
	}
	h.add(&f.regOps, porcupine.Operation{ClientId: w.id, Input: op, Call: call, Return: ret})
}

// robustShardsMember is worker w's member of the Shards: it runs them for
// 2 to 8 s (then leaves), pauses, and joins again, until work ends (ctx
// bounds the rest); a session that ended (a fault) is replaced.
func robustShardsMember(t *testing.T, ctx, work context.Context, w *faultWorker, seed uint64, rng *rand.Rand, h *history) {
	runs, expired := 0, 0
	for work.Err() == nil {
		s, err := w.session(ctx)
		if err != nil {
			continue
		}
		run, cancel := context.WithTimeout(work, time.Duration(2000+rng.IntN(6001))*time.Millisecond)
		err = etcdsync.NewShards(s, robustShards, robustShardsN).Run(run, robustShard(t, w, run, seed, h))
		cancel()
		runs++
		switch {
		case errors.Is(err, etcdsync.ErrSessionExpired):
			expired++
		case errors.Is(err, etcdsync.ErrInvalidArgument): // every member runs robustShardsN
			t.Errorf("worker %d: Shards.Run: %v", w.id, err)
			return
		}
		time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond) // away for a while, not a synchronisation
	}
	t.Logf("worker %d: %d Runs of %s (%d ended with their session)", w.id, runs, robustShards, expired)
}

// robustShard returns worker w's fn for a Run of the Shards whose context
// is run. A run of shard i is a hold of shard i's family from the moment
// fn starts to the moment it returns (both seen in this process: two runs
// of a shard at once fail the lock history's check, whatever the server
// says), in which fn reads and writes the shard's register through the
// fencing token HoldFrom gives, every 50 to 200 ms, until its context
// ends; then it takes up to 300 ms to stop.
func robustShard(t *testing.T, w *faultWorker, run context.Context, seed uint64, h *history) func(context.Context, int) error {
	return func(ctx context.Context, shard int) error {
		start := h.now()
		f := h.shards[shard]
		key, rev, ok := etcdsync.HoldFrom(ctx)
		if !ok || !strings.HasPrefix(key, f.name+"/") {
			t.Errorf("worker %d: shard %d: HoldFrom gave %q, %v", w.id, shard, key, ok)
			<-ctx.Done()
			return ctx.Err()
		}
		h.add(&f.acquires, porcupine.Operation{ClientId: w.id, Input: lockOp{acquire: true, rev: rev, weight: 1}, Call: start, Return: start})
		rng := rand.New(rand.NewPCG(seed, uint64(rev)))
		guard := clientv3.Compare(clientv3.CreateRevision(key), "=", rev)
		do := func(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
			tr, err := w.cli.Txn(ctx).If(guard).Then(ops...).Commit()
			if err == nil && !tr.Succeeded {
				err = etcdsync.ErrNotHeld
			}
			return tr, err
		}
		for seq := 0; ctx.Err() == nil; seq++ {
			select {
			case <-time.After(time.Duration(50+rng.IntN(151)) * time.Millisecond): // the pace of its work
				robustGuarded(ctx, w, do, f, rev, true, fmt.Sprintf("w%d-%d-%d", w.id, rev, seq), h)
			case <-ctx.Done():
			}
		}
		// Shards only try to lock: the hold began with its key. Moved or
		// left (Run's context ended, its cause) is not lost.
		cause := context.Cause(ctx)
		left := run.Err() != nil && errors.Is(cause, run.Err())
		rec := holdRec{worker: w.id, start: rev, rev: rev, weight: 1, doneAt: time.Now(),
			lost: !errors.Is(cause, etcdsync.ErrLockReleased) && !left, contact: errors.Is(cause, etcdsync.ErrLostContact)}
		time.Sleep(time.Duration(rng.IntN(301)) * time.Millisecond) // a fn slow to stop: its last work, not a synchronisation
		end := h.now()
		h.mu.Lock()
		defer h.mu.Unlock()
		f.holds = append(f.holds, rec)
		// Returned before anyone else may run the shard, lost or not (the
		// slack rule), but for an admin's revoke (releaseOps).
		f.releases = append(f.releases, releaseRec{worker: w.id, rev: rev, weight: 1, acquire: start, call: end, ret: end})
		return ctx.Err()
	}
}

// driveFaults strikes one fault at a time, chosen by rng, until length has
// passed, and heals each before the next.
func driveFaults(t *testing.T, ctx context.Context, c *etcdtest.Cluster, admin *clientv3.Client, workers []*faultWorker, log *deleteLog, h *history, rng *rand.Rand, length time.Duration) {
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo)+1)) }
	pause := func(d time.Duration) { time.Sleep(d) } // a fault's duration, not a synchronisation
	adminCtx := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 5*time.Second) }
	members := c.Members()
	start := time.Now()
	for time.Since(start) < length {
		pause(between(50*time.Millisecond, 400*time.Millisecond))
		at := time.Since(start).Round(time.Millisecond)
		v := workers[rng.IntN(len(workers))]
		switch rng.IntN(11) {
		case 0, 1: // a member cut off from its peers; a worker watches through it
			i := rng.IntN(len(members))
			d := between(200*time.Millisecond, 2*time.Second)
			route := rng.IntN(2) == 0
			t.Logf("%v: member %d cut from its peers for %v (worker %d watching through it: %v)", at, i, d, v.id, route)
			if route {
				v.route(i, (i+1)%len(members))
			}
			require.NoError(t, c.CutPeers(members[i]))
			pause(d)
			require.NoError(t, c.HealPeers(members[i]))
			v.route(-1, -1)
		case 10: // a follower lags again and again, shorter than an election
			f := c.Follower()
			if f == nil {
				continue
			}
			i := slices.Index(members, f)
			t.Logf("%v: member %d cut from its peers 8 times for 300 ms (worker %d watching through it)", at, i, v.id)
			v.route(i, (i+1)%len(members))
			for range 8 {
				require.NoError(t, c.CutPeers(f))
				pause(300 * time.Millisecond)
				require.NoError(t, c.HealPeers(f))
				pause(200 * time.Millisecond)
			}
			v.route(-1, -1)
		case 2: // a member stops and restarts, the leader half the time
			m := c.Follower()
			if rng.IntN(2) == 0 {
				m = c.Leader()
			}
			if m == nil {
				continue
			}
			d := between(300*time.Millisecond, 2*time.Second)
			t.Logf("%v: member %d (leader: %v) stopped for %v", at, slices.Index(members, m), m.IsLeader(), d)
			c.Stop(m)
			pause(d)
			require.NoError(t, c.Restart(m))
		case 3:
			t.Logf("%v: leader transfer", at)
			actx, cancel := adminCtx()
			_ = c.TransferLeader(actx) // may fail during an election; the fault is the attempt
			cancel()
		case 4: // a worker's link cut, sometimes past the TTL
			d := between(faultTTL/4, faultTTL+1500*time.Millisecond)
			t.Logf("%v: worker %d cut off for %v", at, v.id, d)
			v.blackhole(true)
			pause(d)
			v.blackhole(false)
		case 5: // a worker's link slowed
			l, d := between(faultTTL/8, faultTTL/2), between(time.Second, 3*time.Second)
			t.Logf("%v: worker %d replies delayed %v for %v", at, v.id, l, d)
			v.latency(l)
			pause(d)
			v.latency(0)
		case 6:
			lease := v.lease()
			t.Logf("%v: worker %d's lease %x revoked", at, v.id, lease)
			actx, cancel := adminCtx()
			if resp, err := admin.Revoke(actx, lease); err == nil { // not found: the session had already ended
				h.adminDid(resp.Header)
			}
			cancel()
		case 7: // one key deleted, whichever it is (holder or waiter)
			actx, cancel := adminCtx()
			resp, err := admin.Get(actx, robustName+"/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
			if err == nil && len(resp.Kvs) > 0 {
				key := string(resp.Kvs[rng.IntN(len(resp.Kvs))].Key)
				t.Logf("%v: key %s deleted (%d under the name)", at, key, len(resp.Kvs))
				if resp, err := admin.Delete(actx, key); err == nil {
					h.adminDid(resp.Header)
				}
			}
			cancel()
		case 8:
			t.Logf("%v: every key under the name deleted", at)
			actx, cancel := adminCtx()
			if resp, err := admin.Delete(actx, robustName+"/", clientv3.WithPrefix()); err == nil {
				h.adminDid(resp.Header)
			}
			cancel()
		case 9: // compaction, no further than every admin's watch has read
			rev := log.rev.Load()
			for _, f := range h.fams {
				rev = min(rev, f.log.rev.Load())
			}
			t.Logf("%v: compaction at %d", at, rev)
			actx, cancel := adminCtx()
			if rev > 0 {
				_, _ = admin.Compact(actx, rev) // already compacted there: nothing to do
			}
			cancel()
		}
	}
}

// The models reject what they must: two holds of a mutex at once, a writer
// beside a reader, permits past the capacity, a lost update, a stale read;
// and accept readers together, permits within the capacity, and a write
// whose outcome is unknown either way.
func TestRobustnessModels(t *testing.T) {
	t.Parallel()
	op := func(in any, call, ret int64) porcupine.Operation {
		return porcupine.Operation{Input: in, Call: call, Return: ret}
	}
	acq := func(rev int64) lockOp { return lockOp{acquire: true, rev: rev, weight: 1} }
	acqW := func(rev, w int64) lockOp { return lockOp{acquire: true, rev: rev, weight: w} }
	rel := func(rev int64) lockOp { return lockOp{rev: rev} }
	mutexModel, rwModel, semModel := holdsModel(1), holdsModel(4), holdsModel(2)
	for _, c := range []struct {
		name  string
		model porcupine.Model
		ops   []porcupine.Operation
		ok    bool
	}{
		{"handoff", mutexModel, []porcupine.Operation{op(acq(1), 0, 1), op(rel(1), 2, 5), op(acq(2), 3, 4)}, true},
		{"two holders", mutexModel, []porcupine.Operation{op(acq(1), 0, 1), op(acq(2), 2, 3), op(rel(1), 4, 5)}, false},
		{"readers share", rwModel, []porcupine.Operation{op(acq(1), 0, 1), op(acq(2), 2, 3), op(rel(1), 4, 5), op(rel(2), 4, 5)}, true},
		{"a writer among readers", rwModel, []porcupine.Operation{op(acq(1), 0, 1), op(acqW(2, 4), 2, 3), op(rel(1), 4, 5)}, false},
		{"a writer after the readers", rwModel, []porcupine.Operation{op(acq(1), 0, 1), op(rel(1), 2, 3), op(acqW(2, 4), 2, 5)}, true},
		{"permits within the capacity", semModel, []porcupine.Operation{op(acq(1), 0, 1), op(acq(2), 2, 3), op(rel(1), 4, 5)}, true},
		{"permits past the capacity", semModel, []porcupine.Operation{op(acqW(1, 2), 0, 1), op(acq(2), 2, 3), op(rel(1), 4, 5)}, false},
		{"increments", registerModel, []porcupine.Operation{op(regOp{read: "init", wrote: "a"}, 0, 1), op(regOp{read: "a", wrote: "b"}, 2, 3), op(regOp{read: "b"}, 4, 5)}, true},
		{"lost update", registerModel, []porcupine.Operation{op(regOp{read: "init", wrote: "a"}, 0, 3), op(regOp{read: "init", wrote: "b"}, 1, 2)}, false},
		{"stale read", registerModel, []porcupine.Operation{op(regOp{read: "init", wrote: "a"}, 0, 1), op(regOp{read: "init"}, 2, 3)}, false},
		{"unknown, applied", registerModel, []porcupine.Operation{op(regOp{read: "init", wrote: "a", unknown: true}, 0, 9), op(regOp{read: "a"}, 2, 3)}, true},
		{"unknown, not applied", registerModel, []porcupine.Operation{op(regOp{read: "init", wrote: "a", unknown: true}, 0, 9), op(regOp{read: "init", wrote: "b"}, 2, 3)}, true},
	} {
		require.Equal(t, c.ok, porcupine.CheckOperations(c.model, c.ops), c.name)
	}
}
